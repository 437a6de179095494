#!/usr/bin/env bash
# Installs the pinned NVRTC 13.0.x (and the CUDA runtime headers and CCCL) from PyPI into a venv, so kernels compile
# to sm_90a cubin on a machine without CUDA or a GPU, then prints the environment to export.
#   bash scripts/setup_nvrtc.sh [DIR]      (default DIR: $HOME/.cache/flashplan-nvrtc)
#   eval "$(bash scripts/setup_nvrtc.sh)"  to export it in the current shell
set -euo pipefail
dir="${1:-${HOME}/.cache/flashplan-nvrtc}"
if [ ! -x "$dir/bin/python" ]; then
    python3 -m venv "$dir" >&2
fi
"$dir/bin/python" -m pip install -q --disable-pip-version-check \
    "nvidia-cuda-nvrtc==13.0.88" "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl>=13.0,<13.1" >&2
site="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cu="$site/nvidia/cu13"
test -e "$cu/lib/libnvrtc.so.13" || { echo "libnvrtc.so.13 not found under $cu/lib" >&2; exit 1; }
echo "export LD_LIBRARY_PATH=\"$cu/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
echo "export FLASHPLAN_CUDA_INCLUDE=\"$cu/include\""
