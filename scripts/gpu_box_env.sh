# Source on the lent GPU box from the repository root (with .gpu_bundle carried, built here by
# scripts/gpu_box_bundle.sh): installs the bundle into /tmp/skyq-site once, puts it and the repository
# on PYTHONPATH, and keeps NVLink multicast off as the box requires.
if [ ! -f /tmp/skyq-site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/skyq-site \
    .gpu_bundle/wheels/*.whl || return 1
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='tar')" \
    .gpu_bundle/ray-*-slim.tar.xz /tmp/skyq-site || return 1  # no xz binary needed
  touch /tmp/skyq-site/.done
fi
export PYTHONPATH="/tmp/skyq-site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
