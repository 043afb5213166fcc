"""Plain explanations of everyday science, cooking, history and practical matters."""

TEXT = """\
Why the Sky Is Blue

Sunlight looks white, but it is a mixture of all the colours of the rainbow. When it enters the
atmosphere, it collides with molecules of nitrogen and oxygen that are much smaller than the
wavelength of the light itself. Such small particles scatter short wavelengths far more strongly
than long ones: blue light, with a wavelength of about 450 nanometres, is scattered roughly five
times as much as red light at 700 nanometres. This effect is called Rayleigh scattering. As a
result, blue light reaches our eyes from every direction in the sky, while the sun itself looks
slightly yellow. At sunrise and sunset the light has to travel through much more air, so most of
the blue is scattered away before it reaches us, and the sky near the horizon glows orange and red.

How Bread Rises

Bread dough is a simple mixture of flour, water, salt and yeast, yet it changes dramatically over
a few hours. Yeast is a living fungus. It feeds on the sugars released from the starch in flour
and produces carbon dioxide and alcohol. Meanwhile, two proteins in wheat flour, glutenin and
gliadin, combine with water to form gluten, a stretchy network that traps the gas in countless
tiny bubbles. Kneading strengthens this network. As the dough proves, the bubbles grow and the
dough rises. In the oven the gas expands further, the alcohol evaporates, the proteins set, and the
starch gelatinises, fixing the airy structure in place. The brown crust comes from the Maillard
reaction between sugars and amino acids, which begins at around 140 degrees Celsius.

A Basic Recipe for Tomato Soup

Ingredients: 1 kg ripe tomatoes, 1 onion, 2 cloves of garlic, 2 tablespoons of olive oil, 500 ml
vegetable stock, 1 teaspoon of sugar, salt and pepper, and a handful of fresh basil.
1. Chop the onion and garlic finely and soften them in the oil over a low heat for 10 minutes.
2. Cut the tomatoes into quarters, add them to the pan, and cook for another 10 minutes.
3. Pour in the stock, add the sugar, and simmer gently for 20 minutes.
4. Blend until smooth, season with salt and pepper, and stir in the torn basil leaves.
Serve hot with crusty bread. The soup keeps for three days in the fridge and freezes well.

The Water Cycle

Water on Earth is always moving. The sun heats the oceans, lakes and rivers, and some of the water
evaporates into the air as vapour. Plants also release water through their leaves, a process known
as transpiration. As the warm, moist air rises, it cools, and the vapour condenses around tiny
particles of dust to form clouds. When the droplets in a cloud grow large enough, they fall as
precipitation: rain, snow, sleet or hail. Some of that water soaks into the ground and becomes
groundwater; some runs off into streams and rivers and eventually returns to the sea. The same
water has been going around this cycle for billions of years, which means that the glass of water
on your table may once have been part of a glacier, a thundercloud, or a dinosaur's drink.

A Short History of Printing

For most of history, books were copied by hand, which made them rare and expensive. Printing with
carved wooden blocks was practised in China by the seventh century, and movable type made of
baked clay was invented there in the eleventh century. Around 1440, Johannes Gutenberg in Mainz
combined several ideas into a practical system: metal type cast in a hand mould, an oil-based ink,
and a press adapted from those used to make wine. His workshop printed the famous Gutenberg Bible
around 1455. Within fifty years, printing presses were operating in more than two hundred European
cities, and millions of books had been produced. Cheaper books spread literacy, helped standardise
spelling and grammar, and allowed scientists to share and check each other's results.

How Vaccines Work

The immune system learns to recognise germs by their shapes, especially the proteins on their
surfaces. The first time it meets a new germ, it needs days to build a strong response, and in
that time a person can become seriously ill. A vaccine gives the immune system a safe preview. It
may contain a weakened or inactivated germ, a harmless piece of one, or instructions that let our
own cells make a single protein from it for a short time. The body responds by producing
antibodies and memory cells. If the real germ arrives later, the memory cells recognise it and the
defence starts within hours instead of days, often before any symptoms appear.

Saving Energy at Home

Small changes add up. Heating and cooling usually account for the largest share of a household's
energy use, so sealing gaps around windows and doors and adding insulation to the loft can make a
big difference. Lowering the thermostat by one degree can cut a heating bill by several percent.
LED bulbs use about a fifth of the electricity of old incandescent bulbs and last many times
longer. Washing clothes at 30 degrees instead of 60 roughly halves the energy used per load. Turn
off devices at the wall rather than leaving them on standby, and let dishes air-dry. None of these
steps is dramatic on its own, but together they can reduce energy use by a quarter or more.

The Planets of the Solar System

Eight planets orbit the sun. The four inner planets, Mercury, Venus, Earth and Mars, are small and
rocky. Mercury is the closest to the sun and has almost no atmosphere, so its temperature swings
from 430 degrees Celsius in the day to minus 180 at night. Venus is wrapped in thick clouds of
sulphuric acid and is the hottest planet of all. Mars is cold and dusty, with the tallest volcano
in the solar system, Olympus Mons. Beyond the asteroid belt lie the giants: Jupiter and Saturn,
made mostly of hydrogen and helium, and Uranus and Neptune, which contain more ice. Jupiter is so
large that more than a thousand Earths would fit inside it. Saturn's rings are made of countless
pieces of ice and rock, some as small as grains of sand and others as big as houses.

How a Bicycle Stays Upright

A moving bicycle seems to balance itself, and for a long time nobody could fully explain why. Part
of the answer is steering: when a bike starts to lean, the rider, often without noticing, turns
the handlebars slightly in the direction of the lean, which brings the wheels back under the centre
of mass. The geometry of the front fork helps as well. Because the point where the front wheel
touches the ground trails behind the steering axis, a leaning bike tends to steer itself into the
lean. The spinning wheels add a small gyroscopic effect. Experiments with specially built bicycles
have shown that no single factor is essential; it is the combination that makes riding possible.

Learning a New Language

Adults can learn languages well, even if they rarely lose their accent entirely. The most reliable
method is regular exposure to material you can mostly understand, a little above your current
level. Reading simple stories, listening to podcasts for learners, and watching films with
subtitles all help. Spaced repetition, in which you review words just before you are likely to
forget them, makes vocabulary stick with far less effort than cramming. Speaking early, even
badly, builds confidence and shows you which words you are missing. Fifteen minutes every day is
worth more than two hours once a week, because memory is strengthened by frequent recall.

The Human Heart

The heart is a muscular pump about the size of a fist. It beats around seventy times a minute at
rest, which adds up to more than two and a half billion beats in an average lifetime. It has four
chambers. The right side receives blood that has delivered its oxygen to the body and pumps it to
the lungs; the left side receives oxygen-rich blood from the lungs and pumps it out through the
aorta to every organ. Valves between the chambers keep the blood flowing in one direction, and
their closing makes the familiar sound of a heartbeat. Regular exercise, a balanced diet, not
smoking and enough sleep are the best ways to keep the heart healthy.
"""
