"""Identities, certificates and sealing; later differential privacy and secure aggregation."""
