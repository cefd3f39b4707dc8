"""HTTP plumbing that knows nothing of K3: request guards (limits, auth, draining) and the uvicorn server."""
