"""What the tests share, importable as `support.<module>` (pyproject.toml puts tests/ on the path):
helpers (a tiny GPT, specs, batches, reference training), real_nets (models as people write them),
ranks (a multi-rank run, once per session), ckpt_hooks (crash points inside a save), and the jobs
that tests start as processes of their own: elastic_job, exit_jobs, peer_jobs, peak_worker, cuda_jobs."""
