#!/usr/bin/env bash
# Validates every Kubernetes manifest in deploy/ offline, against the
# OpenAPI schemas that the PyPI package kubernetes-validate ships (no
# cluster, no network beyond PyPI for the first install). Strict mode:
# an unknown or misspelled field is an error.
#
#   deploy/validate.sh                       # the versions below
#   K8S_VERSIONS="1.35.0" deploy/validate.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

# Oldest and newest Kubernetes minor versions we promise to run on.
K8S_VERSIONS="${K8S_VERSIONS:-1.30.0 1.33.0 1.37.0}"
VALIDATOR_VERSION="1.37.0"
venv="${NETREAP_VALIDATE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/netreap/validate-venv}"
validator="$venv/bin/kubernetes-validate"

# A private virtualenv: no system Python is touched (PEP 668 distributions
# refuse a global pip install), and the validator's version is pinned.
if ! "$validator" --version 2>/dev/null | grep -qF "$VALIDATOR_VERSION"; then
    echo "== installing kubernetes-validate $VALIDATOR_VERSION into $venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "kubernetes-validate==$VALIDATOR_VERSION"
fi

shopt -s nullglob
manifests=("$here"/*.yaml "$here"/*.yml)
if ((${#manifests[@]} == 0)); then
    echo "validate.sh: no manifests in $here" >&2
    exit 1
fi

status=0
for version in $K8S_VERSIONS; do
    echo "== Kubernetes $version (strict)"
    if ! "$validator" --strict --kubernetes-version "$version" "${manifests[@]}"; then
        status=1
    fi
done
if ((status == 0)); then
    echo "validate.sh: ${#manifests[@]} manifest files valid for Kubernetes $K8S_VERSIONS"
else
    echo "validate.sh: invalid manifests (see above)" >&2
fi
exit "$status"
