"""What multi-hop questions need from the passages, as text work any question shares.

A multi-hop ("bridge") question names one entity and asks about another that only the first
entity's passage names: "What position was held by the woman who portrayed Corliss Archer in the
film Kiss and Tell?" needs the Kiss and Tell passage (it names Shirley Temple) and then the Shirley
Temple passage (it holds the answer). The second passage shares few words with the question, so a
single-hop scorer ranks it low and a tight budget drops it. The learned scorer
(ctxgate.compression.sentence_features, ctxgate.compression.learned) follows such links with features fitted on
held-out halves; this package holds the text work they use, and the older query-expansion hop.

The package, one idea per module:

- `names`: how a text names a passage (title cores; linear-time whole-word matching);
- `entities`: the names a sentence adds to the question;
- `expand`: the query-expansion hop (extraction.expand_query, the rag-multihop policy).
"""
