"""Made-up towns (name, one passage each) and a question only one passage answers: shared test data."""

TOWN_FACTS = [
    ("Arlen", "Town Arlen has a population of 1200. It lies on the river Vey. Its mayor is Ida Holm."),
    ("Brisk", "Town Brisk has a population of 5400. It lies on the river Orn. Its mayor is Tomas Veld."),
    ("Cirra", "Town Cirra has a population of 870. It lies on the river Lune. Its mayor is Mara Quist."),
    ("Dovel", "Town Dovel has a population of 23000. It lies on the river Sarn. Its mayor is Pell Ochs."),
    ("Esker", "Town Esker has a population of 310. It lies on the river Tay. Its mayor is Una Brack."),
    ("Fallow", "Town Fallow has a population of 4100. It lies on the river Wend. Its mayor is Rolf Jansk."),
    ("Gorse", "Town Gorse has a population of 650. It lies on the river Yen. Its mayor is Lia Dorn."),
    ("Hollin", "Town Hollin has a population of 9900. It lies on the river Ash. Its mayor is Bran Olk."),
]
TOWN_QUESTION = "Who is the mayor of Cirra?"
