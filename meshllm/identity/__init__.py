"""Keys, certificates, trust policy and signed envelopes: who a node and its owner are."""
