#!/usr/bin/env bash
# Starts sshd when the image has it and a key is given (SSH_PUBLIC_KEY, one or more lines; SSH_PORT,
# default 22), then runs the command (JupyterLab by default).
set -euo pipefail

if [[ -n "${SSH_PUBLIC_KEY:-}" ]]; then
    if [[ ! -x /usr/sbin/sshd ]]; then
        echo "autotune: SSH_PUBLIC_KEY is set but this image has no sshd; build it with --build-arg WITH_SSH=1" >&2
        exit 1
    fi
    mkdir -p /root/.ssh /run/sshd
    chmod 700 /root/.ssh
    touch /root/.ssh/authorized_keys
    while IFS= read -r key; do
        [[ -z "$key" ]] || grep -qxF -- "$key" /root/.ssh/authorized_keys || printf '%s\n' "$key" >> /root/.ssh/authorized_keys
    done <<< "$SSH_PUBLIC_KEY"
    chmod 600 /root/.ssh/authorized_keys
    ssh-keygen -A >/dev/null
    # An SSH session gets the image's PATH (where python, pip and autotune are), not sshd's default.
    session_env="PATH=$PATH"
    [[ -z "${LD_LIBRARY_PATH:-}" ]] || session_env+=" LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    /usr/sbin/sshd -p "${SSH_PORT:-22}" -o PasswordAuthentication=no \
        -o PermitRootLogin=prohibit-password -o "SetEnv=$session_env"
    echo "autotune: sshd listening on port ${SSH_PORT:-22} (key login as root)" >&2
fi

exec "$@"
