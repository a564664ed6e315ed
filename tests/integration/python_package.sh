#!/usr/bin/env bash
# The README's install of the Python package, as a user runs it: a virtual
# environment over Debian's Python (which python3-torch is for), then
# `pip install --no-build-isolation .` offline, then the README's PyTorch
# example run by that environment's Python from outside the source tree
# (so `import hpmoe` is the installed package, not python/ or build/). The
# example runs on the tiny preset instead of qwen3-30b-a3b (2.4 GB of
# weights), with a checkpoint block and tokens made up for it.
set -euo pipefail
src=${HPMOE_SOURCE_DIR:?}
python=${PYTHON:-/usr/bin/python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m venv --system-site-packages "$tmp/venv"
if ! (cd "$src" && "$tmp/venv/bin/pip" install --no-build-isolation --no-index .) > "$tmp/pip.log" 2>&1; then
  cat "$tmp/pip.log"
  echo "error: pip install --no-build-isolation . failed (above)" >&2
  exit 1
fi
tail -2 "$tmp/pip.log"
cd "$tmp"
"$tmp/venv/bin/python" - "$src/README.md" <<'PY'
import re, sys
import torch
import hpmoe

assert "site-packages" in hpmoe.__file__ and "venv" in hpmoe.__file__, hpmoe.__file__
readme = open(sys.argv[1], encoding="utf-8").read()
blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
assert len(blocks) == 1, f"expected one python example in README.md, found {len(blocks)}"
example = blocks[0]
assert 'hpmoe.preset("qwen3-30b-a3b")' in example, "the README example's preset changed: update this test"
example = example.replace('hpmoe.preset("qwen3-30b-a3b")', 'hpmoe.preset("tiny")')
cfg = hpmoe.preset("tiny")
torch.manual_seed(0)
block = {k: v for k, v in hpmoe.MoELayer(cfg, ranks=2).state_dict().items()}
block = {k: torch.randn_like(v) * 0.1 if v.dtype.is_floating_point else v for k, v in block.items()}
x = torch.randn(2, 8, cfg["hidden"], requires_grad=True)
scope = {"block": block, "x": x}
exec(compile(example, "README.md (python example)", "exec"), scope)
moe, y = scope["moe"], scope["y"]
assert y.shape == x.shape and torch.isfinite(y).all()
assert x.grad is not None and torch.isfinite(x.grad).all()
assert moe.gate.weight.grad is not None
assert moe.last_losses is not None and torch.isfinite(moe.last_losses.aux)
print(f"README example: ok with the installed package ({hpmoe.__file__})")
PY
