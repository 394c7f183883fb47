"""`atoll simulate`: a discrete-event simulation of a deployment, its steps decided by atoll's own
scheduler, block pools, router and disaggregation decision (engine.batch, engine.kv,
engine.disagg.decision, imported as they serve) and timed by the planner's cost model.

    from atoll.planner.sim.api import Deployment, simulate
    from atoll.planner.sim.load import random_requests
    out = simulate("Llama-3.1-8B", load_topology("dgx-h200"), Deployment(layout="TP2", replicas=4),
                   random_requests(1000, input_len=2048, output_len=256, vocab_size=128256),
                   rate=20.0, slos={"ttft": 2000, "tpot": 50})
    out["serve"]["tpot_ms"]["p90"], out["engines"][0]["busy_share"]

The output's "serve" is `atoll bench serve`'s report of the same requests (report.py), so one
command line can be simulated or run and the two compared figure by figure.

Modules: api (simulate), load (the requests and their arrivals, shared with the bench), deploy (the
deployment and each engine's cost model and KV capacity), engine (one engine's ticks), clock
(a tick's seconds), run (the event loop and the driver's choices), report (the figures).
"""
