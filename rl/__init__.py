"""Training the InSS scheduler (tritonctl.rl): imitation of search (`imitate`), the SAC-Discrete agent (`sac`), its
environment (`env`), the loop (`train`). Nothing at run time imports it; the trained actor it saves is loaded by
`planning.policies.actor`."""
