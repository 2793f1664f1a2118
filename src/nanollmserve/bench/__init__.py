"""Benchmarks behind `nanollmserve bench ...`: each prints one JSON object on stdout, with the
baselines measured side by side in the same run and the ratios between them."""
