"""Stand-in for SGLang's server (only ``python -m sglang.launch_server``): see launch_server.py here."""
