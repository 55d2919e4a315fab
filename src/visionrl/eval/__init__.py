"""Evaluation on the user's own visual benchmark, locally or through a served endpoint.

- `scoring`: answers -> per-sample records by the training rewards; image ablation;
- `local`: greedy answers from a local engine (also the training loop's periodic eval), `evaluate_local`;
- `endpoint`: the same through an OpenAI-compatible endpoint (openai client), `evaluate_endpoint`;
- `report`: headline numbers, the JSON report and its Markdown twin; `EvalSettings`, what both evaluators
  share (the data check, the rewards, ablation, timing the answers and writing the report).
"""
