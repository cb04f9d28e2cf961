"""The fixed text fp8 KV scales are calibrated on at start-up: prose, dialogue in the chat format, code and
numbers, so that each head's largest |K| and |V| are seen on the kinds of input a server gets."""

CALIBRATION_TEXT = """<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
Summarise the history of the printing press in three sentences, then list two open questions.<|im_end|>
<|im_start|>assistant
Johannes Gutenberg combined movable metal type, oil-based ink and a screw press around 1440 in Mainz. Within fifty
years presses ran in more than 270 European cities and had printed some twenty million volumes, which lowered the
price of books and spread literacy, science and the Reformation. The same design, improved by steam and rotary
presses in the 19th century, dominated printing until offset and digital methods replaced it.
1. How much did earlier Korean and Chinese movable type influence Gutenberg?
2. Why did printing spread so much faster in Europe than elsewhere?<|im_end|>
def mean(values: list[float]) -> float:
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)

SELECT id, name, price * 1.2 AS gross FROM products WHERE stock > 0 ORDER BY gross DESC LIMIT 10;
{"order": 48213, "items": [{"sku": "A-1029", "qty": 3}, {"sku": "Z-77", "qty": 1}], "total_eur": 149.90}
Die Quantenmechanik beschreibt das Verhalten von Materie auf atomarer Ebene. 3.14159 2.71828 1.41421 6.02e23
"""
