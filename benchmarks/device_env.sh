# Source at the start of a device-machine command: installs the carried wheels (.whl/, fetched here by
# benchmarks/device_wheels.sh: trl, deepspeed, datasets and
# the other packages a bare GPU image lacks, fetched with pip download) into /tmp/site, puts them and src/ on
# PYTHONPATH and prints the versions.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
python3 - <<'PY'
import torch, transformers, trl, peft, accelerate, datasets
from importlib.metadata import PackageNotFoundError, version
versions = {m.__name__: m.__version__ for m in (torch, transformers, trl, peft, accelerate, datasets)}
try:
    versions["deepspeed"] = version("deepspeed")  # not imported here: it is slow; scale_out.py uses it
except PackageNotFoundError:
    versions["deepspeed"] = None
print("versions:", versions)
print("gpus:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
