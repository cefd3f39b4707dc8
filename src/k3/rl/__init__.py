"""Post-training (SPEC §7, issue 19): SFT → RL over 3 domains × 3 efforts (nine teachers) → multi-teacher
on-policy distillation, on verifiable toy tasks generated and checked locally, with sandboxes (SPEC §8, AgentENV).

Modules (one job each; this package sits above `k3.train` and `k3.serve` and below the CLI):

* `k3.rl.sandbox` — isolated processes for untrusted code and tool calls: own temporary root, resource limits,
  no network, wall-clock timeout; checkpoint / resume / fork / snapshot; a paused sandbox runs no process.
* `k3.rl.domains` — the three toy domains (math, code, agentic): task generation, system prompts per effort,
  reference solutions, verifiers; `k3.rl.agent` — the agentic environment and its tools.
* `k3.rl.chats` — SFT chat data (``chats.jsonl``) from the domains' reference solutions.
* `k3.rl.sft` — supervised fine-tuning on the K3 chat format, loss on assistant channels only.
* `k3.rl.rewards` — budget reward, verbosity rule, group-normalised advantages, MOPD token rewards.
* `k3.rl.rollout` — partial rollouts over `k3.serve.engine.Engine` with per-token policy versions.
* `k3.rl.grpo` — the RL stage (``k3 rl``); `k3.rl.distill` — MOPD (``k3 distill``).
"""
