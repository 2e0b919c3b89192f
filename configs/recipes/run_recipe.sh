#!/usr/bin/env bash
# Run one recipe: plan it first (fails fast if it does not fit), then start the trainer.
#
#   MODEL_PATH=/models/Meta-Llama-3-70B-Instruct TRAIN_FILES=/data/gsm8k/train.parquet \
#   VAL_FILES=/data/gsm8k/test.parquet NNODES=16 \
#   configs/recipes/run_recipe.sh llama3_70b_ppo_16nodes [key=value ...]
#
# Adapt: MODEL_PATH (actor/ref/critic), CRITIC_PATH and RM_PATH (default MODEL_PATH; the reward model must be an HF
# *ForSequenceClassification directory), TRAIN_FILES / VAL_FILES (verl-layout parquet: python -m
# hybridflow.data.prep_gsm8k), NNODES (change the layout with it: tp*pp must divide NNODES*8), GPU (a100|h100|h200:
# plan for another GPU than the one the recipe names in plan.gpu), RECOMPUTE (the planner's --recompute).
# Extra arguments are dotlist overrides for both the planner and the trainer.
#
# On a cluster, start Ray on every node first (python -m launch.cluster) and set trainer.ray.address, or submit
# this script as a job (python -m launch.submit); both are described in launch/README.md. This script runs the
# trainer in the current shell, on the Ray cluster named by trainer.ray.address (a local one if unset).
set -euo pipefail

name=${1:?usage: run_recipe.sh <recipe name, e.g. llama3_70b_ppo_16nodes> [key=value ...]}
shift
here=$(cd "$(dirname "$0")" && pwd)
config="$here/$name.yaml"
[ -f "$config" ] || { echo "no recipe $config" >&2; exit 2; }
: "${MODEL_PATH:?set MODEL_PATH to the HF model directory}"
: "${TRAIN_FILES:?set TRAIN_FILES to the training parquet}"
PYTHON=${PYTHON:-python}

overrides=(
  "actor_rollout_ref.model.path=$MODEL_PATH"
  "data.train_files=[$TRAIN_FILES]"
  "data.val_files=[${VAL_FILES:-}]"
)
[ -n "${NNODES:-}" ] && overrides+=("trainer.nnodes=$NNODES")
# critic / reward model paths only where the recipe has those roles
if grep -q '^critic:' "$config"; then overrides+=("critic.model.path=${CRITIC_PATH:-$MODEL_PATH}"); fi
if grep -q 'enable: true' "$config"; then overrides+=("reward_model.model.path=${RM_PATH:-$MODEL_PATH}"); fi
[ -z "${VAL_FILES:-}" ] && overrides+=("trainer.val_before_train=false" "trainer.test_freq=-1")

"$PYTHON" -m launch.plan "$config" "${overrides[@]}" "$@" ${GPU:+--gpu "$GPU"} --recompute "${RECOMPUTE:-none}"
exec "$PYTHON" -m hybridflow.trainer.main --config "$config" "${overrides[@]}" "$@"
