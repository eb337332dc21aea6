"""kvshare beside vLLM on the same GPU and the same traces: the rows both sides run (rows.py), vLLM's
offline runner (vllm_offline.py) and the ratio table over both sides' JSON (ratio_table.py)."""
