#!/usr/bin/env bash
# make setup: build the course's laptop/CI environment in ./.venv, idempotently.
#
#   1. create .venv (Python 3.11)
#   2. pip install -r requirements.txt (+ requirements-nodeps.txt with --no-deps)
#   3. build Horovod 0.28.1 from its sdist with our patch (tools/horovod/), or reuse the cached wheel
#   4. point DeepSpeed's JIT op cache (TORCH_EXTENSIONS_DIR) outside the checkout
#
# A second run only checks stamps and takes seconds. Rebuilds happen when requirements, the torch/TF
# versions, the Horovod patch or the CUDA mode change.
#
# Not for ALCF machines: there the frameworks and the MPI come from the modules (frameworks on Aurora, conda
# on Polaris and Sophia), and a venv with the PyPI mpich wheel would shadow them. See README.md ("On ALCF machines").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
CACHE="${SCALING_DL_CACHE:-$HOME/.cache/scaling-dl}"
HOROVOD_VERSION=0.28.1
PATCH="$ROOT/tools/horovod/horovod-$HOROVOD_VERSION.patch"

CURRENT_STEP="start"
step() { CURRENT_STEP="$1"; printf '\n==> [setup %s] %s\n' "$1" "$2"; }
on_error() { printf '\nmake setup FAILED at step %s (see the output above).\n' "$CURRENT_STEP" >&2; }
trap on_error ERR

sha() { sha256sum | cut -c1-16; }

# A first install fills the venv with ~7.3 GB (torch's PyPI wheel is its CUDA build, 4 GB of it CUDA
# libraries) and pip's temporary files; a disk that runs out mid-install leaves a broken venv and pip's
# OSError. So say it first, in one line. SCALING_DL_NEED_GB changes the figure.
NEED_GB="${SCALING_DL_NEED_GB:-12}"
need_space() {
  local dir="$1"
  while [[ ! -d "$dir" ]]; do dir=$(dirname "$dir"); done
  local free_kb
  free_kb=$(df -Pk "$dir" | awk 'NR == 2 {print $4}')
  if (( free_kb < NEED_GB * 1024 * 1024 )); then
    printf 'error: make setup needs about %s GB free to install the frameworks into %s; its disk has %s GB free (free some space, or set VENV= to a folder on a disk with room)\n' \
      "$NEED_GB" "$1" "$(awk -v kb="$free_kb" 'BEGIN {printf "%.1f", kb / 1048576}')" >&2
    exit 1
  fi
}

# --- 0. refuse to shadow an ALCF software stack --------------------------------------------------
# Aurora: /lus/flare. Polaris and Sophia (ThetaGPU's nodes) share /lus/eagle and /soft/modulefiles.
# (Theta and ThetaGPU, with /lus/theta-fs0, stopped running jobs on 2023-12-31.)
if [[ -z "${SCALING_DL_FORCE_VENV:-}" ]] && { [[ -d /soft/modulefiles ]] || [[ -d /lus/flare ]] || [[ -d /lus/eagle ]]; }; then
  cat >&2 <<'EOF'
This looks like an ALCF machine (Aurora, Polaris or Sophia). Do not build the laptop venv here: its PyPI
mpich wheel and pip-installed frameworks would shadow the machine's MPI (Cray MPICH on Aurora and Polaris,
Open MPI on Sophia) and the GPU builds of its modules. Use instead:
  Aurora:   module load frameworks
  Polaris:  module use /soft/modulefiles; module load conda; conda activate
  Sophia:   module use /soft/modulefiles; module load conda; conda activate base
and the job scripts in submissions/. (SCALING_DL_FORCE_VENV=1 overrides this check; not recommended.)
EOF
  exit 1
fi

# --- 1. virtual environment -----------------------------------------------------------------------
step 1/4 "virtual environment in $VENV"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -c 'import sys; assert sys.version_info[:2] >= (3, 9), sys.version' ||
    { echo "need Python >= 3.9 (3.11 tested); set PYTHON=/path/to/python3.11" >&2; false; }
  "$PYTHON" -m venv "$VENV"
  echo "created $VENV"
else
  echo "exists"
fi
PY="$VENV/bin/python"
export TF_CPP_MIN_LOG_LEVEL=3  # TensorFlow's import banner is noise here
PIP=("$PY" -m pip --disable-pip-version-check)

# --- 2. pinned Python packages ----------------------------------------------------------------------
step 2/4 "pinned packages (requirements.txt, requirements-nodeps.txt)"
REQ_KEY=$(cat "$ROOT/requirements.txt" "$ROOT/requirements-nodeps.txt" <("$PY" -V) | sha)
if [[ "$(cat "$VENV/.stamp-requirements" 2>/dev/null)" == "$REQ_KEY" ]]; then
  echo "up to date ($REQ_KEY)"
else
  need_space "$VENV"
  echo "installing (torch, TensorFlow and DeepSpeed: a few minutes the first time)"
  "${PIP[@]}" install --progress-bar off -r "$ROOT/requirements.txt" | grep -v '^Requirement already satisfied'
  "${PIP[@]}" install --progress-bar off --no-deps -r "$ROOT/requirements-nodeps.txt" | grep -v '^Requirement already satisfied'
  echo "$REQ_KEY" > "$VENV/.stamp-requirements"
fi

# --- 3. Horovod, built against the installed torch and TensorFlow ------------------------------------
step 3/4 "Horovod $HOROVOD_VERSION (PyTorch + TensorFlow + Gloo + MPI)"
# Versions read from the installed files, not by importing the frameworks (seconds each): a no-op setup is quick.
TORCH_V=$("$PY" -c 'import importlib.util as u, pathlib, re
print(re.search(r"^__version__\s*=\s*.([^\x27\x22]+)", (pathlib.Path(u.find_spec("torch").origin).parent /
                "version.py").read_text(), re.M)[1])')
TF_V=$("$PY" -c 'import importlib.metadata as m; print(m.version("tensorflow-cpu"))' 2>/dev/null ||
       "$PY" -c 'import importlib.metadata as m; print(m.version("tensorflow"))')
# CUDA stays on only where a real toolkit exists (nvcc *and* its headers); a stray nvcc is not enough.
NVCC_PATH=$(command -v nvcc || true)
CUDA_ROOT="${CUDA_HOME:-${NVCC_PATH:+$(dirname "$(dirname "$NVCC_PATH")")}}"
if [[ -n "$CUDA_ROOT" && -f "$CUDA_ROOT/include/cuda_runtime.h" ]]; then CUDA_MODE=cuda; else CUDA_MODE=cpu; fi
HVD_KEY=$(printf '%s ' "$HOROVOD_VERSION" "$TORCH_V" "$TF_V" "$CUDA_MODE" "$("$PY" -V)" "$(sha < "$PATCH")" | sha)
WHEEL_DIR="$CACHE/horovod/$HVD_KEY"
echo "torch $TORCH_V, TensorFlow $TF_V, CUDA mode: $CUDA_MODE, cache key $HVD_KEY"

# (the key holds torch's and TensorFlow's versions: another build of either makes another key, and a new wheel)
HVD_LIB="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/horovod"
if [[ "$(cat "$VENV/.stamp-horovod" 2>/dev/null)" == "$HVD_KEY" ]] && compgen -G "$HVD_LIB/torch/mpi_lib_v2*.so" >/dev/null \
   && compgen -G "$HVD_LIB/tensorflow/mpi_lib*.so" >/dev/null; then
  echo "installed and up to date"
else
  if ! compgen -G "$WHEEL_DIR/horovod-*.whl" >/dev/null; then
    echo "no cached wheel in $WHEEL_DIR: building from source (~7 min on 2 cores, once)"
    BUILD=$(mktemp -d)
    trap 'rm -rf "$BUILD"' EXIT
    "${PIP[@]}" download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD" >/dev/null
    tar xzf "$BUILD/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD"
    (cd "$BUILD/horovod-$HOROVOD_VERSION" && patch -p1 --quiet < "$PATCH")
    echo "patched with $(basename "$PATCH"); compiling (output in $BUILD/build.log)"
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
    export HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" CMAKE_POLICY_VERSION_MINIMUM=3.5
    [[ "$CUDA_MODE" == cpu ]] && export HOROVOD_TORCH_NO_CUDA=1
    # MPI comes from the venv's mpich wheel (mpicxx, mpi.h, libmpi) on a laptop.
    export PATH="$VENV/bin:$PATH"
    if ! (cd "$BUILD/horovod-$HOROVOD_VERSION" &&
          "${PIP[@]}" wheel --no-build-isolation --no-deps --no-cache-dir -w "$BUILD/wheel" . > "$BUILD/build.log" 2>&1); then
      tail -40 "$BUILD/build.log" >&2
      false
    fi
    mkdir -p "$WHEEL_DIR"
    mv "$BUILD"/wheel/horovod-*.whl "$WHEEL_DIR/"
    echo "cached $(ls "$WHEEL_DIR")"
  else
    echo "using cached wheel $(ls "$WHEEL_DIR")"
  fi
  "${PIP[@]}" install --progress-bar off --force-reinstall --no-deps "$WHEEL_DIR"/horovod-*.whl
  # (TensorFlow writes absl's and oneDNN's start-up lines from C++ whatever TF_CPP_MIN_LOG_LEVEL says: dropped)
  imported=$("$PY" -c 'import horovod.torch, horovod.tensorflow' 2>&1) || { echo "$imported" >&2; false; }
  if [[ -n "$imported" ]]; then
    grep -Ev 'absl::InitializeLog|oneDNN custom operations are on' <<< "$imported" >&2 || true
  fi
  echo "$HVD_KEY" > "$VENV/.stamp-horovod"
fi

# --- 4. DeepSpeed JIT op cache ------------------------------------------------------------------------
step 4/4 "DeepSpeed JIT op cache"
# course/dist.py sets the same default when TORCH_EXTENSIONS_DIR is unset, so plain `python` runs share it:
# one folder per Python environment (a build records the environment's paths; another venv would rebuild it).
ENV_ID=$("$PY" -c 'import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:8])')
EXT_DIR="${TORCH_EXTENSIONS_DIR:-$CACHE/torch_extensions/$ENV_ID}"
mkdir -p "$EXT_DIR"
echo "TORCH_EXTENSIONS_DIR=$EXT_DIR"
# cpu_adam (DeepSpeedCPUAdam) is the one op the course needs: ZeRO-Offload (deepspeed/main.py --offload,
# zero/main.py). Built here once (~1-2 min on 2 cores) so that no test pays for it under a timeout.
# Not needed: fused_adam ("torch_adam": true in deepspeed/ds_config.json) and deepspeed_shm_comm (an
# inference-only all-reduce that deepspeed/main.py marks as unavailable on CPUs).
# (deepspeed prints its accelerator warning on stdout: keep only the last line)
DS_KEY=$(echo "$("$PY" -c 'import importlib.metadata as m; print(m.version("deepspeed"))') $TORCH_V" | sha)
if [[ "$(cat "$EXT_DIR/.stamp-cpu_adam" 2>/dev/null)" == "$DS_KEY" ]] && compgen -G "$EXT_DIR/cpu_adam/cpu_adam*.so" >/dev/null; then
  echo "cpu_adam: cached ($DS_KEY)"
else
  echo "cpu_adam: building (JIT, once)"
  TORCH_EXTENSIONS_DIR="$EXT_DIR" "$PY" -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' \
    2>&1 | grep -v -e WARNING -e 'No CUDA runtime' || true
  compgen -G "$EXT_DIR/cpu_adam/cpu_adam*.so" >/dev/null || { echo "cpu_adam did not build" >&2; false; }
  echo "$DS_KEY" > "$EXT_DIR/.stamp-cpu_adam"
fi

trap - ERR
printf '\nmake setup: done. Next: make doctor, make demo, make test.\n'
