"""Fixed few-shot exemplars of the hfd_* generative tasks (copied from lm-evaluation-harness 0.4.13).

* ``GSM8K_COT``: the 8 chain-of-thought exemplars of Wei et al. 2022 (lm-eval ``gsm8k-cot``), (question, answer).
* ``MINERVA_MATH``: the 4 Minerva exemplars (Lewkowycz et al. 2022; lm-eval ``minerva_math``), (problem, solution).
* ``MBPP``: MBPP prompt-split tasks 2, 3 and 4 (Austin et al. 2021; lm-eval ``mbpp``).
"""

GSM8K_COT = [('There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, there '
  'will be 21 trees. How many trees did the grove workers plant today?',
  'There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have been '
  '21 - 15 = 6. The answer is 6.'),
 ('If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?',
  'There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5.'),
 ('Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?',
  'Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, they '
  'had 74 - 35 = 39. The answer is 39.'),
 ('Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did Jason '
  'give to Denny?',
  'Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. The '
  'answer is 8.'),
 ('Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have now?',
  'Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. 5 + 4 = 9. The '
  'answer is 9.'),
 ('There were nine computers in the server room. Five more computers were installed each day, from monday to '
  'thursday. How many computers are now in the server room?',
  'There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 computers '
  'were added. 9 + 20 is 29. The answer is 29.'),
 ('Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf balls '
  'did he have at the end of wednesday?',
  'Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, he '
  'had 35 - 2 = 33 golf balls. The answer is 33.'),
 ('Olivia has $23. She bought five bagels for $3 each. How much money does she have left?',
  'Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars left. '
  '23 - 15 is 8. The answer is 8.')]

MINERVA_MATH = [('Find the domain of the expression  $\\frac{\\sqrt{x-2}}{\\sqrt{5-x}}$.',
  'The expressions inside each square root must be non-negative. Therefore, $x-2 \\ge 0$, so $x\\ge2$, and $5 - x '
  '\\ge 0$, so $x \\le 5$. Also, the denominator cannot be equal to zero, so $5-x>0$, which gives $x<5$. '
  'Therefore, the domain of the expression is $\\boxed{[2,5)}$.\n'
  'Final Answer: The final answer is $[2,5)$. I hope it is correct.'),
 ('If $\\det \\mathbf{A} = 2$ and $\\det \\mathbf{B} = 12,$ then find $\\det (\\mathbf{A} \\mathbf{B}).$',
  'We have that $\\det (\\mathbf{A} \\mathbf{B}) = (\\det \\mathbf{A})(\\det \\mathbf{B}) = (2)(12) = '
  '\\boxed{24}.$\n'
  'Final Answer: The final answer is $24$. I hope it is correct.'),
 ('Terrell usually lifts two 20-pound weights 12 times. If he uses two 15-pound weights instead, how many times '
  'must Terrell lift them in order to lift the same total weight?',
  'If Terrell lifts two 20-pound weights 12 times, he lifts a total of $2\\cdot 12\\cdot20=480$ pounds of weight.  '
  'If he lifts two 15-pound weights instead for $n$ times, he will lift a total of $2\\cdot15\\cdot n=30n$ pounds '
  'of weight.  Equating this to 480 pounds, we can solve for $n$:\n'
  '\\begin{align*}\n'
  '30n&=480\\\\\n'
  '\\Rightarrow\\qquad n&=480/30=\\boxed{16}\n'
  '\\end{align*}\n'
  'Final Answer: The final answer is $16$. I hope it is correct.'),
 ('If the system of equations\n'
  '\n'
  '\\begin{align*}\n'
  '6x-4y&=a,\\\\\n'
  '6y-9x &=b.\n'
  '\\end{align*}has a solution $(x, y)$ where $x$ and $y$ are both nonzero,\n'
  'find $\\frac{a}{b},$ assuming $b$ is nonzero.',
  'If we multiply the first equation by $-\\frac{3}{2}$, we obtain\n'
  '\n'
  '$$6y-9x=-\\frac{3}{2}a.$$Since we also know that $6y-9x=b$, we have\n'
  '\n'
  '$$-\\frac{3}{2}a=b\\Rightarrow\\frac{a}{b}=\\boxed{-\\frac{2}{3}}.$$\n'
  'Final Answer: The final answer is $-\\frac{2}{3}$. I hope it is correct.')]

MBPP = [{'task_id': 2,
  'text': 'Write a function to find the similar elements from the given two tuple lists.',
  'code': 'def similar_elements(test_tup1, test_tup2):\r\n'
          '  res = tuple(set(test_tup1) & set(test_tup2))\r\n'
          '  return (res) ',
  'test_list': ['assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)',
                'assert similar_elements((1, 2, 3, 4),(5, 4, 3, 7)) == (3, 4)',
                'assert similar_elements((11, 12, 14, 13),(17, 15, 14, 13)) == (13, 14)']},
 {'task_id': 3,
  'text': 'Write a python function to identify non-prime numbers.',
  'code': 'import math\r\n'
          'def is_not_prime(n):\r\n'
          '    result = False\r\n'
          '    for i in range(2,int(math.sqrt(n)) + 1):\r\n'
          '        if n % i == 0:\r\n'
          '            result = True\r\n'
          '    return result',
  'test_list': ['assert is_not_prime(2) == False',
                'assert is_not_prime(10) == True',
                'assert is_not_prime(35) == True']},
 {'task_id': 4,
  'text': 'Write a function to find the largest integers from a given list of numbers using heap queue algorithm.',
  'code': 'import heapq as hq\r\n'
          'def heap_queue_largest(nums,n):\r\n'
          '  largest_nums = hq.nlargest(n, nums)\r\n'
          '  return largest_nums',
  'test_list': ['assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],3)==[85, 75, 65] ',
                'assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],2)==[85, 75] ',
                'assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],5)==[85, 75, 65, 58, 35]']}]
