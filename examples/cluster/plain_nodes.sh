#!/usr/bin/env bash
# ONI on plain machines: one learner node (GPU), CPU nodes for the NetHack env workers, GPU nodes
# for the LLM. Run each block on the machine it names, in this order; every machine has the same
# Python environment (pip install -e ".[ray,vllm]" in the same path, same Ray version).
# Sizing and what happens when a node dies: docs/cluster.md.
set -euo pipefail

HEAD=learner-node        # the Ray head: the learner runs here
LLM=gpu-node-1           # one vLLM server (several: see the LLM pool docs)
MODEL=meta-llama/Llama-3.1-8B-Instruct
# Secrets come from the environment, never from this file (a placeholder that works is a key
# everyone knows). Make each once and give the same value to every node, e.g.
#   export ONI_SERVE_API_KEY=$(python -c "import secrets; print(secrets.token_urlsafe(32))")
#   export RAY_AUTH_TOKEN=$(python -c "import secrets; print(secrets.token_urlsafe(32))")   # Ray >= 2.52
: "${ONI_SERVE_API_KEY:?set ONI_SERVE_API_KEY to a secret shared by the LLM server and the learner (see above)}"
: "${RAY_AUTH_TOKEN:?set RAY_AUTH_TOKEN to a secret shared by every Ray node (see above)}"
export OPENAI_API_KEY=$ONI_SERVE_API_KEY   # the learner's client sends the server's key
# Ray's own access token on every node and for oni-train: anyone who reaches the head's port runs
# code otherwise.
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN

case "${1:-}" in
llm)  # on $LLM: an OpenAI-compatible server; prints http://$LLM:8000/v1 once it answers
    oni-serve --backend vllm --model "$MODEL" --host 0.0.0.0 --port 8000
    ;;
head)  # on $HEAD: no CPUs for env actors (the learner, the annotation client and reward-model
       # training use this machine's cores), no GPU for Ray (the learner takes it with --device cuda)
    ray start --head --port=6379 --num-cpus=0 --num-gpus=0 --include-dashboard=false
    ;;
worker)  # on every CPU node: one env actor per core, two cores left to Ray's own processes
    ray start --address="$HEAD:6379" --num-cpus=$(( $(nproc) - 2 )) --num-gpus=0
    ;;
train)  # on $HEAD once the workers have joined (`ray status` lists them): one command.
        # --workers: total env actors = the CPUs the worker nodes offer (ray status, "CPU");
        # --envs-per-worker 32: one PPO batch per worker is 32 games x 32 steps = 1024 frames;
        # each run gets a new folder runs/oni-<date>-<time> (named when it starts), LOGDIR=<that
        # folder> RESUME=1 continues it (oni-train never writes over a run without --resume)
    WORKERS=${WORKERS:?set WORKERS to the number of CPUs the worker nodes offer}
    oni-train --backend ray --ray-address "$HEAD:6379" --workers "$WORKERS" --envs-per-worker 32 \
        --device cuda --task score --intrinsic-reward retrieval \
        --llm-url "http://$LLM:8000/v1" --llm-model "$MODEL" ${LOGDIR:+--logdir "$LOGDIR"} ${RESUME:+--resume}
    ;;
stop)  # on every node at the end
    ray stop
    ;;
*)
    echo "usage: $0 {llm|head|worker|train|stop}" >&2
    exit 2
    ;;
esac
