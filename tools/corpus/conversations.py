"""Questions and answers in the tone of an assistant, and everyday dialogue."""

TEXT = """\
User: Hi! Can you help me plan a three-day trip to the mountains?
Assistant: Of course. Here is a simple plan. On the first day, arrive early, check in, and take an
easy walk around the lake to get used to the altitude. On the second day, start at sunrise and
hike to the summit viewpoint; bring plenty of water, snacks, a warm layer and sun cream. On the
third day, rest your legs with a scenic drive or a visit to the local market before heading home.
Would you like suggestions for places to stay?

User: What is the difference between weather and climate?
Assistant: Weather is what the atmosphere is doing at a particular time and place: today's rain,
tomorrow's wind, this afternoon's temperature. Climate is the average pattern of weather over a
long period, usually thirty years or more. A simple way to remember it: climate is what you
expect, weather is what you get.

User: How many minutes are there in a week?
Assistant: There are 60 minutes in an hour and 24 hours in a day, so a day has 1,440 minutes.
Multiplying by 7 days gives 10,080 minutes in a week.

User: Can you explain what a prime number is?
Assistant: A prime number is a whole number greater than 1 that can only be divided evenly by 1
and by itself. For example, 2, 3, 5, 7, 11 and 13 are prime. The number 12 is not prime, because
it can be divided by 2, 3, 4 and 6. The number 2 is the only even prime.

User: Write a short poem about autumn.
Assistant: Here is one:
The maples blush in shades of flame,
the evening comes before it's late;
the geese write letters in the sky,
and leaves go dancing past the gate.

User: I feel nervous about my job interview tomorrow. Any advice?
Assistant: It is completely normal to feel nervous. A few things can help. Prepare two or three
short stories about times you solved a problem, worked in a team, or learned from a mistake.
Read about the company so you can ask a thoughtful question at the end. Lay out your clothes and
documents tonight, and plan to arrive ten minutes early. During the interview, it is fine to pause
before answering. Remember that they invited you because they are interested in you. Good luck!

User: What's the capital of Australia?
Assistant: The capital of Australia is Canberra. Many people guess Sydney or Melbourne, which are
larger cities, but Canberra was chosen as a compromise between the two and became the capital in
1913.

User: Thanks, that's really helpful.
Assistant: You're welcome! Let me know if there is anything else I can do for you.

User: Translate "good morning" into French, Spanish and German.
Assistant: French: "Bonjour." Spanish: "Buenos días." German: "Guten Morgen."

User: Summarize the plot of a mystery story in two sentences.
Assistant: A detective arrives at a snowbound country house where a wealthy guest has been found
dead in a locked library. By questioning each of the other guests and noticing that the clock in
the hall was running fast, she reveals that the quiet secretary staged the scene to hide the time
of the crime.

"Are you coming to the market?" asked Priya, pulling on her coat.
"In a minute," said Leo. "I can't find my other shoe."
"It's under the sofa, where it always is."
"How did you know that?"
"Because that's where you left it yesterday, and the day before, and the day before that."
Leo laughed, fished the shoe out, and followed her into the bright, cold morning.

User: Is it better to study in the morning or at night?
Assistant: It depends on the person. Some people concentrate best early in the day, while others
are more alert in the evening. What matters most is sleep: memories are consolidated while you
sleep, so studying late and then sleeping too little can undo much of the work. Try both for a
week and notice when you remember more.

User: Give me three tips for writing clear emails.
Assistant: 1. Put the main point or request in the first two sentences.
2. Keep paragraphs short, and use a list when you have several items.
3. Write a specific subject line, such as "Budget review moved to Friday 3 pm" instead of "Update".

User: How do I convert Celsius to Fahrenheit?
Assistant: Multiply the temperature in Celsius by 9, divide by 5, and add 32. For example, 20
degrees Celsius is 20 x 9 / 5 + 32 = 68 degrees Fahrenheit. To go the other way, subtract 32,
multiply by 5, and divide by 9.

User: Why do cats purr?
Assistant: Cats purr when they are content, but also when they are stressed, hurt, or giving birth,
so purring is not only a sign of happiness. It is produced by rapid movements of the muscles in the
larynx. Some researchers think the low-frequency vibrations may even help bones and tissues heal.

User: Can you recommend a good habit for better sleep?
Assistant: One of the most effective habits is keeping a regular schedule: go to bed and get up at
the same time every day, including weekends. It also helps to keep the bedroom dark and cool, to
avoid caffeine after lunch, and to put screens away half an hour before bed.

"Excuse me, is this the train to Edinburgh?"
"Yes, it leaves from platform four at twenty past nine. You've got plenty of time."
"Thank you so much. Do you know if there's a café on board?"
"There's a trolley that comes round after York. The tea's not bad, actually."

User: Explain recursion like I'm five.
Assistant: Imagine you are standing in a line and want to know how many people are in front of you.
You ask the person ahead of you, and they ask the person ahead of them, and so on. The person at the
very front says "zero!" Then each person adds one and passes the answer back. When it reaches you,
you know the answer. Recursion is solving a problem by asking a smaller version of the same question.

User: What should I pack for a beach holiday?
Assistant: Swimwear, a light cover-up, sunglasses, a wide-brimmed hat, and high-factor sun cream are
the essentials. Add sandals, a reusable water bottle, a book, and a small first-aid kit with plasters
and after-sun lotion. If you plan to snorkel, bring your own mask; rented ones are often leaky.
"""
