"""The built-in training prompts of `atoll spec train-eagle3`: request forms crossed with topics,
shuffled once so that the first N mix forms and topics. They are kept apart from the `chat`
prompts of `atoll bench spec` (its held-out set): no topic shares a word with those prompts
(tests/cli/test_spec_prompts.py checks it)."""

from __future__ import annotations

import random

TOPICS = [
    "volcanoes", "the moon", "bread", "bicycles", "honey bees", "chess", "glaciers", "the human heart",
    "electric cars", "coffee", "the Roman empire", "rain forests", "airplanes", "music", "computers",
    "the solar system", "penguins", "recycling", "photosynthesis", "earthquakes", "libraries", "the internet",
    "gardening", "dinosaurs", "the printing press", "vaccines", "solar panels", "wind turbines", "bridges",
    "trains", "the stock market", "saving money", "budgeting", "job interviews", "public speaking",
    "learning a language", "writing a resume", "time management", "meditation", "yoga", "running",
    "swimming", "football", "basketball", "the Olympic games", "photography", "painting", "pottery",
    "knitting", "baking cookies", "pizza", "rice", "cheese", "chocolate", "vegetables", "vitamins",
    "the immune system", "the brain", "bones", "muscles", "dreams", "memory", "friendship", "teamwork",
    "leadership", "negotiation", "climate change", "forests", "rivers", "mountains", "islands", "caves",
    "tornadoes", "lightning", "snow", "the seasons", "stars", "black holes", "comets", "Mars", "Jupiter",
    "rockets", "satellites", "telescopes", "microscopes", "atoms", "magnets", "electricity", "batteries",
    "light bulbs", "the telephone", "radio", "television", "video games", "robots", "artificial intelligence",
    "programming", "Python", "databases", "passwords", "email", "spreadsheets", "smartphones", "clocks",
    "maps", "the compass", "ancient Egypt", "the pyramids", "castles", "knights", "pirates", "Vikings",
    "the Great Wall of China", "democracy", "elections", "taxes", "banks", "insurance", "renting a flat",
    "moving house", "houseplants", "composting", "bird watching", "dogs", "cats", "horses", "elephants",
    "whales", "sharks", "octopuses", "butterflies", "ants", "spiders", "frogs", "owls", "eagles",
    "mushrooms", "trees", "flowers", "tomatoes", "apples", "bananas", "potatoes", "soup", "pasta",
    "camping", "hiking", "maps and navigation", "road trips", "museums", "theatre", "poetry", "novels",
    "fairy tales", "mathematics", "fractions", "geometry", "statistics", "probability", "chemistry",
    "physics", "biology", "genetics", "evolution", "fossils", "archaeology", "languages", "grammar",
    "handwriting", "keyboards", "shoes", "clothes", "washing machines", "refrigerators", "microwaves",
]

FORMS = [
    "Explain {} in simple words.", "Give me three facts about {}.", "Write a short paragraph about {}.",
    "What should a beginner know about {}?", "Tell me something surprising about {}.",
    "Describe {} to a ten-year-old.", "What are the main ideas behind {}?", "Summarize the history of {}.",
    "List five things people often get wrong about {}.", "Why do people care about {}?",
    "Write a haiku about {}.", "Give me a fun fact about {}.", "How would you teach someone about {}?",
    "What questions could a quiz about {} ask?", "Write two sentences about {}.",
    "Compare {} with something from everyday life.", "What is the most important thing to know about {}?",
    "Write a short story that involves {}.", "What are the pros and cons of {}?",
    "Can you give me some advice about {}?", "Define {} in one sentence, then explain it.",
    "What jobs are connected to {}?", "Write a limerick about {}.", "How has {} changed over time?",
]


def builtin_prompts() -> list[str]:
    """Every form crossed with every topic, in one fixed shuffled order."""
    texts = [form.format(topic) for topic in TOPICS for form in FORMS]
    random.Random(0).shuffle(texts)
    return texts
