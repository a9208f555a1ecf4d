#!/usr/bin/env bash
# On a lent GPU (no network): `make demo`'s kill-and-heal on the GPU, with torchft 0.2.0 and with torchft's next API
# (torchft-nightly 2026.10.26), fp32 and bf16-mixed. Both groups share the one GPU, so the cross-group process group
# is Gloo (NCCL refuses two ranks on one device). The wheels travel in .whl/ (torchft 0.2.0 and what it needs, see
# ../shared/notes/gpu.md) and .whl/next/ (the nightly); each demo's log goes to $OUT/demo-<torchft>-<precision>/.
# Usage (device tool, carry .whl): bash benchmarks/gpu/gpu_compat.sh
set -uo pipefail
OUT="${OUT:-/tmp/gpu_compat}"
mkdir -p /tmp/bin "$OUT"
ln -sf "$(command -v python3)" /tmp/bin/python  # the launcher runs `python examples/train.py`
export PATH="/tmp/bin:$PATH"
python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl
python3 -m pip install --quiet --no-index --no-deps --target /tmp/site-next .whl/next/*.whl
nvidia-smi -L
status=0
for case in "0.2 32-true" "next 32-true" "next bf16-mixed"; do
    set -- $case
    torchft="$1" precision="$2" run="$OUT/demo-$1-$2"
    path="/tmp/site:$PWD"
    [[ "$torchft" == next ]] && path="/tmp/site-next:$path"
    PYTHONPATH="$path" python3 -c "import torch, torchft, lightning_ft.process_group.torchft_api as api; \
print('== torchft $torchft ($precision):', torchft.__file__, 'reconfigure API:', api.RECONFIGURE_API, \
'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    started=$(date +%s)
    if PYTHONPATH="$path" timeout 150 python3 examples/demo.py --run-dir "$run" -- --trainer.accelerator=gpu \
        --trainer.devices=1 --trainer.precision="$precision" --trainer.strategy.init_args.process_group=gloo; then
        echo "== torchft $torchft ($precision): passed in $(( $(date +%s) - started )) s"
    else
        echo "== torchft $torchft ($precision): FAILED"; status=1
    fi
    grep -m2 "GPU available\|Using bfloat16" "$run/launch.log"
done
exit $status
