"""Triton itself: rendering model repositories, finding the server binary, the clients (own and perf_analyzer)."""
