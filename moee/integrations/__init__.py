"""Adapters to distributed data engines (optional extras): ``moee.integrations.ray`` (``moee[ray]``)."""
