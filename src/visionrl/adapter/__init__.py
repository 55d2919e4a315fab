"""The LoRA adapter as an artifact, from the run directory to a server's disk.

- `files`: the file names, reading `adapter_config.json` and safetensors headers, peft's LoRA targets;
- `manifest`: `visionrl_manifest.json` (what the adapter is, checksums of its files) and verification;
- `servable`: whether vLLM serves an adapter as trained, and with which flags (pure);
- `storage`: a folder or `s3://` URL as an fsspec filesystem;
- `export`: a run's adapter to a folder or object store, manifest last;
- `fetch`: an export to a verified local copy (what a server reads).
"""
