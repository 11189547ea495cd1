"""Chat prompts for training and evaluating draft heads, made from templates in this file (nothing
is downloaded): instruction templates x subjects, the subjects split into a training set and a
held-out set that shares no subject with it, so held-out acceptance measures generalisation to
new topics in the same chat style.
"""

from __future__ import annotations

import random

TEMPLATES = (
    "Write a short story about {s}.",
    "Explain {s} to a ten-year-old.",
    "Give me five tips about {s}.",
    "What are the pros and cons of {s}?",
    "Write a short poem about {s}.",
    "Describe {s} in three paragraphs.",
    "Write a friendly email to a colleague about {s}.",
    "What are the most common misconceptions about {s}?",
    "Summarize the history of {s} in a few sentences.",
    "Write a dialogue between two friends discussing {s}.",
    "List the key facts everyone should know about {s}.",
    "How would you teach a beginner about {s}?",
    "Tell me something interesting about {s}.",
    "Write a haiku about {s}.",
    "Why do people care about {s}?",
    "Write the opening paragraph of a blog post about {s}.",
    "Create a quiz with three questions about {s}, and give the answers.",
    "Write a short speech about {s}.",
    "What would the world be like without {s}?",
    "Give me a step-by-step plan for a school project about {s}.",
    "Write a product description inspired by {s}.",
    "What questions would a curious child ask about {s}? Answer them.",
    "Write a diary entry from someone who just discovered {s}.",
    "Explain {s} in one paragraph, then give an example.",
)

SUBJECTS = (
    "a dragon who is afraid of the dark", "the water cycle", "learning a new language",
    "electric cars", "the ocean at night", "volcanoes", "working from home", "photosynthesis",
    "a robot that wants to paint", "healthy breakfast habits", "the moon landing", "gardening",
    "saving money", "black holes", "a lost dog finding its way home", "recycling",
    "the human heart", "public libraries", "playing chess", "rainforests", "time management",
    "the invention of the printing press", "a city built in the clouds", "honey bees",
    "learning to cook", "renewable energy", "the Roman empire", "a friendship between a cat "
    "and a mouse", "sleep", "climbing mountains", "the internet", "bicycles", "earthquakes",
    "writing a good essay", "a haunted lighthouse", "coffee", "the solar system",
    "team sports", "a journey across the desert", "vaccines", "origami", "public speaking",
    "the first day at a new school", "penguins", "music lessons", "deserts", "trains",
    "a talking tree", "budget travel", "weather forecasts", "ancient Egypt", "a kind stranger",
    "the immune system", "birthday parties", "snowstorms", "the game of football",
    "a magical library", "coral reefs", "starting a small business", "owls",
    "the history of chocolate", "wind turbines", "a pirate who gets seasick", "dinosaurs",
    "learning to play the guitar", "the stock market", "friendship", "the Great Wall of China",
    "a detective who solves a mystery at school", "electricity", "rain", "smartphones",
    "the Arctic", "a spaceship's first voyage", "yoga", "elephants", "building a treehouse",
    "the French revolution", "baking bread", "mathematics", "a painter who lost her colors",
    "clouds", "fast food", "job interviews", "the periodic table", "a lonely giant", "tigers",
    "camping", "video games", "air pollution", "the pyramids", "a summer on a farm",
    "gratitude", "microscopes", "submarines", "kites",
)
HELD_OUT_SUBJECTS = (
    "a knight who loves baking", "tides and the moon", "learning to swim", "solar panels",
    "a village under the sea", "glaciers", "online shopping", "the human brain",
    "a clockmaker's apprentice", "drinking enough water", "the Olympic games", "bird watching",
    "planning a picnic", "comets", "a balloon that escaped", "composting",
)


def chat_prompts(num: int, *, held_out: bool = False, seed: int = 0) -> list[str]:
    """`num` distinct instructions (template x subject, shuffled with `seed`) from the training
    subjects, or with `held_out` from the held-out ones; at most templates x subjects."""
    subjects = HELD_OUT_SUBJECTS if held_out else SUBJECTS
    pairs = [t.format(s=s) for s in subjects for t in TEMPLATES]
    if num > len(pairs):
        raise ValueError(f"num={num} prompts asked; the {'held-out' if held_out else 'training'}"
                         f" set has {len(pairs)} (templates x subjects)")
    random.Random(seed).shuffle(pairs)
    return pairs[:num]
