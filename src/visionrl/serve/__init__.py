"""Serving exported adapters with vLLM's OpenAI-compatible server.

- `server`: the command line and environment of the server, starting it with adapters, `visionrl serve`;
- `adapters`: the settings an adapter needs, and load / unload / list on a running server;
- `process`: the server as a child process in its own process group (start, wait until ready, stop).
"""
