"""Shadow comparisons: a sample of live requests answered again from the uncompressed prompt on idle
capacity, and how far the two answers agree (`runner`, `compare`, `ledger`, `metrics`, `load`, `log`)."""
