# autotune with JupyterLab as the default command: the same environment for a whole team,
# wherever it runs. docs/container.md has the details (Docker, and buildah/podman without a daemon).
#
#   docker build -t autotune .
#   docker run --gpus all -p 8888:8888 -v "$PWD":/work autotune        # then open the printed URL
#
# CPU only, on a plain Python base with the CPU torch wheel:
#   docker build --build-arg BASE_IMAGE=python:3.12-slim \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t autotune:cpu .
#
# SSH (optional): build with --build-arg WITH_SSH=1 and pass your public key:
#   docker run --gpus all -p 8888:8888 -p 2222:22 -e SSH_PUBLIC_KEY="$(cat ~/.ssh/id_ed25519.pub)" autotune
#
# The default base carries torch 2.13 (CUDA 12.6, drivers 560+): autotune needs torch 2.13 or newer
# (autotune/version.py's TORCH_FLOOR), and the build stops on an older torch (TORCH_MIN).
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
FROM ${BASE_IMAGE}

# torch is installed only where the base has none (a plain Python image). TORCH_SPEC is what pip
# installs: a requirement (torch, torch==2.13.0), a wheel's URL or a wheel file in a build volume;
# TORCH_INDEX_URL, when given, is the only index pip reads it from
# (https://download.pytorch.org/whl/cpu: the CPU-only wheel; PyPI's Linux torch is the CUDA build).
ARG TORCH_SPEC=torch
ARG TORCH_INDEX_URL=
ARG TORCH_MIN=2.13
# PIP_BREAK_SYSTEM_PACKAGES: the image is the environment, so pip installs into the base's own
# Python even where that Python is marked externally managed (Debian, Ubuntu).
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_BREAK_SYSTEM_PACKAGES=1

RUN if ! python3 -c "import torch" 2>/dev/null; then \
        pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"; \
    fi \
    && python3 -c "import sys, torch; have = tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]); need = tuple(int(p) for p in sys.argv[1].split('.')[:2]); print('torch', torch.__version__, '(CUDA', str(torch.version.cuda) + ')'); sys.exit(0 if have >= need else 'autotune: this base has torch ' + torch.__version__ + '; FSDP planning needs torch ' + sys.argv[1] + ' or newer: pick another BASE_IMAGE, or set TORCH_MIN to accept it')" "$TORCH_MIN"

ARG WITH_SSH=0
RUN if [ "$WITH_SSH" = "1" ]; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openssh-server \
        && rm -rf /var/lib/apt/lists/* \
        && mkdir -p /run/sshd /root/.ssh \
        && chmod 700 /root/.ssh; \
    fi

WORKDIR /opt/autotune
COPY . .
# The README's install command, then the notebook and plotting extras; editable both times, so
# the image runs /opt/autotune's source.
RUN pip install -e . \
    && pip install -e ".[plot]" jupyterlab \
    && autotune --version

COPY docker/entrypoint.sh /usr/local/bin/autotune-entrypoint
# The examples (the notebook first) where JupyterLab opens; a folder mounted on /work hides them,
# and /opt/autotune/examples keeps the originals.
COPY examples /work/examples
RUN chmod 755 /usr/local/bin/autotune-entrypoint

WORKDIR /work
EXPOSE 8888 22
ENTRYPOINT ["/usr/local/bin/autotune-entrypoint"]
CMD ["jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--no-browser", "--allow-root", "--ServerApp.root_dir=/work"]
