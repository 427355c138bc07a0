# autotune on CUDA PyTorch, with JupyterLab as the default command: the same environment for a
# whole team, wherever it runs.
#
#   docker build -t autotune .
#   docker run --gpus all -p 8888:8888 -v "$PWD":/work autotune        # then open the printed URL
#
# SSH (optional): build with --build-arg WITH_SSH=1 and pass your public key:
#   docker run --gpus all -p 8888:8888 -p 2222:22 -e SSH_PUBLIC_KEY="$(cat ~/.ssh/id_ed25519.pub)" autotune
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG WITH_SSH=0
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN if [ "$WITH_SSH" = "1" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends openssh-server \
        && rm -rf /var/lib/apt/lists/* \
        && mkdir -p /run/sshd /root/.ssh \
        && chmod 700 /root/.ssh; \
    fi

WORKDIR /opt/autotune
COPY . .
# The README's install command, then the notebook and plotting extras.
RUN pip install -e . \
    && pip install jupyterlab ".[plot]"

COPY docker/entrypoint.sh /usr/local/bin/autotune-entrypoint
RUN chmod 755 /usr/local/bin/autotune-entrypoint

WORKDIR /work
EXPOSE 8888 22
ENTRYPOINT ["/usr/local/bin/autotune-entrypoint"]
CMD ["jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--no-browser", "--allow-root", "--ServerApp.root_dir=/work"]
