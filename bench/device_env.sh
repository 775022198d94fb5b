# Sourced by the scripts that run on a device machine: $OUT (the folder whose files come back) and the wheels
# that travel in .whl/ installed into /tmp/site, which PYTHONPATH then puts before the tree.
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
