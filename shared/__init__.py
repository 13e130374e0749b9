"""Code shared by every process: protocol, client, config, logging. Imports no service."""
