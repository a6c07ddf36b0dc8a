"""When a question needs a second hop, and which passages and sentences that hop must keep.

A multi-hop ("bridge") question names one entity and asks about another that only the first
entity's passage names: "What position was held by the woman who portrayed Corliss Archer in the
film Kiss and Tell?" needs the Kiss and Tell passage (it names Shirley Temple) and then the Shirley
Temple passage (it holds the answer). The second passage shares few words with the question, so a
single-hop scorer ranks it low and a tight budget drops it.

The trigger is what the first hop found: a passage the question names by title, or the first
hop's best sentences, name another passage of the request (by title) that the question does not
name, or another passage names the best first-hop passage. That passage is the bridge. The
question's form decides how hard it is followed:

- with a bridge form (the asked-about thing is described through another one: a relative clause
  "the woman who portrayed ...", a reduced relative "a movie starring ...", a role "the director
  of ..."), the chain link -> answer -> bridge lead sentence is kept whole;
- without one, the bridge's best sentences are only offered, below the first hop's: a single-hop
  question whose passage names related articles keeps its budget.

The package, one idea per module:

- `names`: how a text names a passage (title cores, owners, undated forms; linear-time matching);
- `forms`: the question's bridge forms;
- `plan`: the trigger, from the first hop's best sentences (plain string work, no model call);
- `rerank`: the bridges the rerank cut must keep (before sentence scores exist);
- `follow`: the hop followed after sentence scoring (extraction.second_hop "auto"): the bridge's
  sentences lifted and chained to the sentence that names it, and one hop further;
- `expand`: the older query-expansion hop (extraction.expand_query).
"""
