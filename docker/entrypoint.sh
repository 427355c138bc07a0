#!/usr/bin/env bash
# Starts sshd when the image has it and a key is given (SSH_PUBLIC_KEY), then runs the command
# (JupyterLab by default).
set -euo pipefail

if [[ -n "${SSH_PUBLIC_KEY:-}" ]]; then
    if ! command -v sshd >/dev/null 2>&1; then
        echo "autotune: SSH_PUBLIC_KEY is set but this image has no sshd; build it with --build-arg WITH_SSH=1" >&2
        exit 1
    fi
    printf '%s\n' "$SSH_PUBLIC_KEY" >> /root/.ssh/authorized_keys
    chmod 600 /root/.ssh/authorized_keys
    ssh-keygen -A >/dev/null
    /usr/sbin/sshd -o PasswordAuthentication=no -o PermitRootLogin=prohibit-password
fi

exec "$@"
