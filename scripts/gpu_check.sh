#!/usr/bin/env bash
# The learner's checks on one CUDA machine, in a few minutes: benchmarks/gpu_trainer.py (results in
# benchmarks/results/gpu_trainer-<model>.json, written after every variant, with publishing's share of the step),
# benchmarks/plan_check.py (dapo plan's peak against the measured one, PLAN_PRESET default dapo-qwen2.5-math-1.5b:
# plan_check-<preset>.json), then the gpu-marked tests; the results are copied to $OUT where set.
# Needs torch, transformers and accelerate; the project's other dependencies are pure Python (or manylinux wheels):
# where the machine cannot reach an index, put them as wheels in .whl/ (benchmarks/README.md, "GPU trainer").
#
#     scripts/gpu_check.sh [all | PARTS] [model shape: 0.5b | 1.5b | 7b]
#     PARTS: a comma list of bench, plan, tests (e.g. plan,tests: a lease's 10-minute call holds bench alone).
#     (BENCH_SECONDS bounds the benchmark, default 400; PLAN_SECONDS the plan check, default 240, PLAN_COMPILED=1
#     also measures the compiled update; TEST_SECONDS the tests, default 150; BENCH_STEPS the timed steps a
#     variant, default 2). The benchmark goes first: its figures are what a short lease is for, and it writes them
#     after every variant.
set -u
what=${1:-all}
model=${2:-1.5b}
wants() { [ "$what" = all ] || [[ ",$what," == *",$1,"* ]]; }
logs=${OUT:-/tmp}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site || exit 1
fi
nvidia-smi -L
python3 -c "import torch, transformers, accelerate; from learner import attention
print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__,
      torch.cuda.get_device_name(), 'varlen kernel:', attention.available(True, torch.bfloat16))"
if wants bench; then
    timeout "${BENCH_SECONDS:-400}" python3 -m benchmarks.gpu_trainer --model "$model" --steps "${BENCH_STEPS:-2}" \
        --write 2>&1 | tee "$logs/gpu_trainer.log"
    if [ -n "${OUT:-}" ]; then cp "benchmarks/results/gpu_trainer-$model.json" "$OUT/" 2>/dev/null; fi
fi
if wants plan; then
    preset=${PLAN_PRESET:-dapo-qwen2.5-math-1.5b}
    timeout "${PLAN_SECONDS:-240}" python3 -m benchmarks.plan_check --preset "$preset" ${PLAN_COMPILED:+--compiled} \
        --write 2>&1 | tee "$logs/plan_check.log"
    if [ -n "${OUT:-}" ]; then cp "benchmarks/results/plan_check-$preset.json" "$OUT/" 2>/dev/null; fi
fi
if wants tests; then
    timeout "${TEST_SECONDS:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/integration/test_trainer_gpu.py \
        2>&1 | tee "$logs/gpu_tests.log"
fi
exit 0
