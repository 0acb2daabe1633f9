"""24 short, varied user prompts for the engine tests (written for this suite, not from a benchmark)."""

PROMPTS: list[str] = [
    # coding
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a JavaScript function that checks whether a string is a palindrome, ignoring case.",
    "Fix the bug in this Python code:\n\ndef average(xs):\n    return sum(xs) / len(xs) + 1",
    "Write a SQL query that lists the five customers with the highest total order amount "
    "from tables customers(id, name) and orders(customer_id, amount).",
    "Write a bash one-liner that counts the lines of every .py file in the current directory.",
    # explanation
    "Explain what a hash table is to a beginner programmer.",
    "Why is the sky blue? Answer in three sentences.",
    "What is the difference between a process and a thread?",
    "Explain how photosynthesis works in simple terms.",
    # lists
    "List five tips for getting better sleep.",
    "Give me a packing list for a two-day hiking trip.",
    "Name six countries in South America and their capitals.",
    "List the planets of the solar system in order from the Sun.",
    # math word problems
    "A train travels 180 km in 2 hours. At the same speed, how far does it travel in 5 hours?",
    "Sara has 3 boxes with 12 apples each. She gives away 15 apples. How many apples does she have left?",
    "A shirt costs $40 and is on sale for 25% off. What is the sale price?",
    "If a rectangle has a perimeter of 30 cm and a width of 5 cm, what is its length?",
    # rewriting
    "Rewrite this sentence in a more formal tone: \"hey, can u send me the report asap?\"",
    "Rewrite the following in the passive voice: The committee approved the new budget on Monday.",
    "Make this sentence shorter: In the event that it happens to rain tomorrow, we will be moving "
    "the picnic to an indoor location.",
    # summarisation
    "Summarise the following paragraph in one sentence:\n\n"
    "The city council met on Tuesday to discuss the new bike lane project. Supporters argued that "
    "the lanes would reduce traffic and make cycling safer for children going to school. Opponents "
    "worried about the loss of parking spaces for local shops. After a long debate, the council voted "
    "to build the lanes on two streets as a one-year trial.",
    # misc
    "Write a haiku about autumn leaves.",
    "Translate 'Where is the train station?' into French and Spanish.",
    "Give three ideas for a birthday party for a ten-year-old.",
]

assert len(PROMPTS) == 24
