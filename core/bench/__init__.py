"""``pagebatch bench``: the benchmark commands (like ``vllm bench``), one file per concept.

- command.py: the ``bench`` subcommand's parser and ``run_bench`` (throughput / latency: the
  workload, the runs, ``--compare``, the table and ``--output`` JSON);
- workload.py: the random-token workloads of throughput and latency (``--preset nanovllm``);
- offline.py: pagebatch's side of throughput and latency (``bench_pagebatch``, ``run_workload``,
  ``weight_bytes``);
- hf.py: the compare adapter for Hugging Face transformers (``--compare hf``, its own process);
- prefix.py: ``bench prefix`` (prefix caching on/off, ``fcfs`` vs ``lpm``);
- serve.py, serve_metrics.py: ``bench serve``, a load generator for any OpenAI-compatible
  server, and its TTFT / TPOT / ITL / E2EL summary;
- roofline.py, kernel_split.py: scripts/roofline.py's floors (from the model's sizes and the
  steps as scheduled) and its split of a profiled run's kernels into categories.

Heavy imports (torch, the engine, transformers, httpx) happen inside the functions that run.
"""
