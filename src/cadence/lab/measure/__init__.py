"""What the lab reads from the server and the host while a run lasts: its processes and threads,
CPU and card samples, its metrics page, its HTTP/2 settings, its spans, where the run happened."""
