"""The controller sidecar: watch the instances' metrics, re-plan as rates move, apply.

Every tick it reads each instance's Triton metrics endpoint (Prometheus text), estimates
each model's arrival rate over a sliding window and its queue, and compares the rates
with those the applied plan was sized for. A model whose rate stays beyond the threshold
for `confirm` ticks (and no change in the last `cooldown_s`) triggers the InSS two-layer
logic: BDA on the current placement and shares first, which needs no new process (batch
sizes reload in place); only when BDA finds no feasible batch does the configured policy
re-plan placement and shares (shadow swaps). Each applied plan is saved in the state
folder; `controller.json` there says what the controller runs and has decided, and the
same is served as JSON (/state) and Prometheus metrics (/metrics).

Dead parts are healed: an instance whose process died, or a proxy that stopped answering,
is noticed at the next tick and the plan applied last is applied again (the same start path
as `apply`, warm-up included); the affected models' rates are unknown (None) until a new
window of samples has come in, so a gap in traffic is never taken for a fall in load.

The operator keeps control: when the plan file the controller was started with changes
(a new `tritonctl plan`, an edit), the controller applies it and sizes from there. Without
a latency model it only follows that file and reports rates.

Killed and restarted, it re-applies the last plan it meant to apply: running instances
that match are kept (adopted), a half-done swap is finished, nothing is duplicated.
"""
