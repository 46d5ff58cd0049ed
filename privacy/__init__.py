"""What protects a silo and its data: identities, certificates and signed policies, the privacy
ledger, its receipts and their audit, the accountant, sealed hand-offs, and the cryptographic
pieces of secure aggregation (pairwise masking, CKKS). See docs/architecture.md."""
