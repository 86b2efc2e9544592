#!/usr/bin/env bash
# Prepare the GPU benchmark's carry folder .gpu/ (git-ignored), here, before a device run:
#   - wheels of what the device image lacks or has in another version (the versions of this .venv; greenlet:
#     service/runtime/preempt.py, which bench/decode.py's DecodeBatch imports),
#     built for its Python 3.12 on x86-64 (/work/.library/device/README.md, "Notes");
#   - the embedded model's tokenizer files (the random-weight 8B models need ids, not the GGUF).
# Then, with the device tool:  run(command="bash bench/gpu/run.sh", carry=[".gpu"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
rm -rf .gpu && mkdir -p .gpu/whl .gpu/tokenizer
specs=$($PY - <<'PYEOF'
from importlib.metadata import version
names = ["transformers", "pydantic", "pydantic-core", "pydantic-settings", "annotated-types",
         "typing-inspection", "python-dotenv", "typing-extensions", "regex", "greenlet"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PYEOF
)
for spec in $specs; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl "$spec"
done
$PY - <<'PYEOF'
from service.config import Settings
from service.runtime.gguf import convert_gguf
from service.runtime.loader import gguf_source
import shutil
s = Settings()
src = convert_gguf(gguf_source("embedded"), s.models_dir, s.home / "fingerprints.json")  # converts once if needed
for f in src.iterdir():
    if f.name != "model.safetensors":
        shutil.copy(f, ".gpu/tokenizer/")
PYEOF
du -sh .gpu .gpu/whl .gpu/tokenizer
