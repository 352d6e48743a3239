"""Tool calls and the sandbox that runs them: parsing calls (calls), running one call under a
backend (sandbox), the sandbox server (server) and its clients (client)."""
