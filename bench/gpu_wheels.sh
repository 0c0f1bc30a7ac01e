#!/usr/bin/env bash
# Download the wheels bench/gpu_wheels.txt lists into .whl/ (ignored by git) for the lent GPU
# machine, which has no network: Python 3.12 on x86-64 Linux, as the device notes give the command.
# A pure-Python package with no wheel on the index (antlr4-python3-runtime 4.9.3) is built here.
# Then it prints each wheel's size and checks the repo and .whl/ fit far under what a call carries.
#
#   bash bench/gpu_wheels.sh        # then: run(command="bash bench/gpu_check.sh", carry=[".whl"])
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
rm -rf .whl
mkdir -p .whl
grep -v '^\s*#' bench/gpu_wheels.txt | grep -v '^\s*$' | while read -r requirement; do
    if ! "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${PLATFORMS[@]}" -d .whl "$requirement" 2>/dev/null; then
        echo "no wheel of $requirement on the index: building it here (pure Python only)"
        "$PY" -m pip wheel --quiet --no-deps -w .whl "$requirement"
    fi
done
for wheel in .whl/*.whl; do  # a wheel built here must run anywhere
    case $wheel in *-none-any.whl | *cp312*manylinux*x86_64*.whl | *abi3*manylinux*x86_64*.whl) ;;
        *) echo "error: $wheel does not install on the image's Python 3.12 x86-64" >&2; exit 1 ;;
    esac
done
ls -l .whl | awk 'NR > 1 {printf "%9d  %s\n", $5, $9}'
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "wheels: $(ls .whl/*.whl | wc -l) files, $((wheels / 1024)) KiB;" \
    "tracked files $((tracked / 1024)) KiB"
if [ $((wheels + tracked)) -gt $((32 * 1024 * 1024)) ]; then  # a call carries 64 MiB at most
    echo "error: the repo and .whl/ take over 32 MiB, half of what one call may carry" >&2
    exit 1
fi
