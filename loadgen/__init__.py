"""`pdserve bench` and `pdserve plan`: load generation against a running system, and a
discrete-event simulator of one for sizing prefill and decode pools. Torch-free.

Modules, in the order a benchmark uses them: `arrivals` (open-loop arrival processes),
`lengths` and `workload` (what each request asks for), `backends` (gRPC through
`pdserve.client`, or OpenAI HTTP), `runner` (sends at arrival times), `records` and `stats`
(client-side latencies, percentiles, SLO attainment), `goodput` (sweep or bisection), `bench`
(the whole run, JSON), `plot` (PNG; matplotlib imported only there). The planner: `costs` (a
measured or assumed cost profile), `simulator`, `planner`.

Nothing is imported here, so `import pdserve.loadgen` stays light.
"""
