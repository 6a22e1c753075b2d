#!/usr/bin/env bash
# The Hugging Face tests against other transformers releases than the one `make env` installs:
#   scripts/hf_versions.sh 5.4.0 5.14.1
# Each release goes into a folder of its own under ${TMPDIR:-/tmp} (pip --target, with the
# huggingface_hub and tokenizers it requires), put ahead of the project's environment on
# PYTHONPATH (with the release's own pin of kernels); needs the network once per release.
set -euo pipefail
python=${PYTHON:-.venv/bin/python}
status=0
for version in "$@"; do
    site=${TMPDIR:-/tmp}/sattn-transformers-$version
    if [[ ! -d $site/transformers ]]; then
        "$python" -m pip install -q --target "$site" "transformers==$version"
        # kernels, which the environment's newer transformers requires, is imported by older
        # releases too, whose hub-kernels module fails on its current version: their own pin, beside them
        spec=$(PYTHONPATH=$site "$python" -c \
            "from transformers.dependency_versions_table import deps; print(deps.get('kernels', ''))")
        if [[ -n $spec ]]; then
            "$python" -m pip install -q --no-deps --target "$site" "$spec"
        fi
    fi
    echo "== transformers $version"
    PYTHONPATH=$site "$python" -m pytest -o addopts= -q -p no:cacheprovider tests/test_hf_transformers.py tests/test_hf_format.py \
        || status=1
done
exit $status
