"""How the lab shows a result: the terminal summary, the HTML report and its plots, comparisons
of runs, sweeps and capacity searches."""
