"""The speculative-decoding benchmark's workloads (`spec_benchmark.py`), also replayed by
`experiments/eval_draft_heads.py --prompts=chat`: 8 **copy** prompts (the answer copies from
the prompt: the prompt-lookup drafter's home ground) and 8 **chat** prompts (open-ended
questions: little to copy)."""

PASSAGE = ("The old lighthouse stood at the edge of the cliff for more than a hundred years. "
           "Every night its keeper climbed the narrow stairs, cleaned the great lens, and lit "
           "the lamp so that ships could find their way home through the fog.")
CODE = ("def total(xs):\n    s = 0\n    for x in xs:\n        s = s + x\n    return s\n\n"
        "def mean(xs):\n    s = 0\n    for x in xs:\n        s = s + x\n    return s / len(xs)\n")
COPY_PROMPTS = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Fix the spelling mistakes in this text and return the corrected text only:\n\n"
    f"{PASSAGE.replace('lighthouse', 'lighthose').replace('keeper', 'keper')}",
    f"Rename the variable `s` to `acc` in this Python code and return the code:\n\n{CODE}",
    f"Rewrite this text with every sentence on its own line:\n\n{PASSAGE}",
    f"Add a docstring to each function in this code and return the whole code:\n\n{CODE}",
    f"Copy this text and put it in quotation marks:\n\n{PASSAGE}",
    f"Convert this code to use the built-in sum() where possible and return the code:\n\n{CODE}",
    f"Return this text in all capital letters:\n\n{PASSAGE}",
]
CHAT_PROMPTS = [
    "Write a short story about a cat who learns to fly.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five tips for staying focused while studying.",
    "What are the main differences between a violin and a cello?",
    "Describe your ideal weekend in a small mountain town.",
    "How do bees make honey?",
    "Write a friendly email inviting a colleague to lunch.",
    "What should I pack for a three-day hiking trip?",
]
WORKLOADS = {"copy": COPY_PROMPTS, "chat": CHAT_PROMPTS}
