"""The few-shot exemplars of ``eval.fewshot`` / ``delft eval --fewshot K``: the first eight problems of the GSM8K
train split (github.com/openai/grade-school-math, MIT (c) 2021 OpenAI), answers whole (calculator annotations
included, as the harness shows them), in the prompt format of lm-evaluation-harness's ``gsm8k`` task.

The harness's ``gsm8k`` task draws its five exemplars at random from the train split for each problem; delft takes
the first K for every problem and every model, so models compare on identical prompts (the harness's ``first_n``
sampler, which its chain-of-thought GSM8K tasks use). docs/evaluation.md#gsm8ks-two-scores-lm-evaluation-harness
"""

from __future__ import annotations

from delft.data.prompts import written_completion, written_question

# lm-evaluation-harness gsm8k.yaml: doc_to_text, the target delimiter, the few-shot delimiter.
QUESTION = "Question: {question}\nAnswer:"
TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"

EXEMPLARS = (
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
     "How many clips did Natalia sell altogether in April and May?",
     "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
     "altogether in April and May.\n#### 72"),
    ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How "
     "much did she earn?",
     "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
     "$<<0.2*50=10>>10.\n#### 10"),
    ("Betty is saving money for a new wallet which costs $100. Betty has only half of the money she "
     "needs. Her parents decided to give her $15 for that purpose, and her grandparents twice as much "
     "as her parents. How much more money does Betty need to buy the wallet?",
     "In the beginning, Betty has only 100 / 2 = $<<100/2=50>>50.\nBetty's grandparents gave her 15 * 2 "
     "= $<<15*2=30>>30.\nThis means, Betty needs 100 - 50 - 30 - 15 = $<<100-50-30-15=5>>5 more.\n#### 5"),
    ("Julie is reading a 120-page book. Yesterday, she was able to read 12 pages and today, she read "
     "twice as many pages as yesterday. If she wants to read half of the remaining pages tomorrow, how "
     "many pages should she read?",
     "Maila read 12 x 2 = <<12*2=24>>24 pages today.\nSo she was able to read a total of 12 + 24 = "
     "<<12+24=36>>36 pages since yesterday.\nThere are 120 - 36 = <<120-36=84>>84 pages left to be "
     "read.\nSince she wants to read half of the remaining pages tomorrow, then she should read 84/2 = "
     "<<84/2=42>>42 pages.\n#### 42"),
    ("James writes a 3-page letter to 2 different friends twice a week.  How many pages does he write a "
     "year?",
     "He writes each friend 3*2=<<3*2=6>>6 pages a week\nSo he writes 6*2=<<6*2=12>>12 pages every "
     "week\nThat means he writes 12*52=<<12*52=624>>624 pages a year\n#### 624"),
    ("Mark has a garden with flowers. He planted plants of three different colors in it. Ten of them "
     "are yellow, and there are 80% more of those in purple. There are only 25% as many green flowers "
     "as there are yellow and purple flowers. How many flowers does Mark have in his garden?",
     "There are 80/100 * 10 = <<80/100*10=8>>8 more purple flowers than yellow flowers.\nSo in Mark's "
     "garden, there are 10 + 8 = <<10+8=18>>18 purple flowers.\nPurple and yellow flowers sum up to 10 "
     "+ 18 = <<10+18=28>>28 flowers.\nThat means in Mark's garden there are 25/100 * 28 = "
     "<<25/100*28=7>>7 green flowers.\nSo in total Mark has 28 + 7 = <<28+7=35>>35 plants in his "
     "garden.\n#### 35"),
    ("Albert is wondering how much pizza he can eat in one day. He buys 2 large pizzas and 2 small "
     "pizzas. A large pizza has 16 slices and a small pizza has 8 slices. If he eats it all, how many "
     "pieces does he eat that day?",
     "He eats 32 from the largest pizzas because 2 x 16 = <<2*16=32>>32\nHe eats 16 from the small "
     "pizza because 2 x 8 = <<2*8=16>>16\nHe eats 48 pieces because 32 + 16 = <<32+16=48>>48\n#### 48"),
    ("Ken created a care package to send to his brother, who was away at boarding school.  Ken placed a "
     "box on a scale, and then he poured into the box enough jelly beans to bring the weight to 2 "
     "pounds.  Then, he added enough brownies to cause the weight to triple.  Next, he added another 2 "
     "pounds of jelly beans.  And finally, he added enough gummy worms to double the weight once again. "
     " What was the final weight of the box of goodies, in pounds?",
     "To the initial 2 pounds of jelly beans, he added enough brownies to cause the weight to triple, "
     "bringing the weight to 2*3=<<2*3=6>>6 pounds.\nNext, he added another 2 pounds of jelly beans, "
     "bringing the weight to 6+2=<<6+2=8>>8 pounds.\nAnd finally, he added enough gummy worms to double "
     "the weight once again, to a final weight of 8*2=<<8*2=16>>16 pounds.\n#### 16"),
)
MAX_SHOTS = len(EXEMPLARS)


def fewshot_prompt(question: str, shots: int, data_cfg=None) -> str:
    """The harness's prompt: ``shots`` exemplars (question, answer), then the question and ``Answer:``. With a data
    section whose data.numbers writes numbers otherwise, the exemplars' answers (and with scope everything the
    questions) are written in that form, as the run trained: an exemplar must not show a form the model was not
    taught."""
    def answer(a: str) -> str:
        return a if data_cfg is None else written_completion(a, data_cfg)

    def asked(q: str) -> str:
        return q if data_cfg is None else written_question(q, data_cfg)

    parts = [QUESTION.format(question=asked(q)) + TARGET_DELIMITER + answer(a) + FEWSHOT_DELIMITER
             for q, a in EXEMPLARS[:shots]]
    return "".join(parts) + QUESTION.format(question=asked(question))


def question_text(example) -> str:
    """The question of an example for the harness's prompt: a text prompt stripped, a chat's last user turn."""
    if isinstance(example.prompt, list):
        users = [m["content"] for m in example.prompt if m.get("role") == "user"]
        return str(users[-1] if users else example.prompt[-1]["content"]).strip()
    return str(example.prompt).strip()
