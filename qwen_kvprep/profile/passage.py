"""The built-in text of `profile --quality`: plain English prose written for qwen-kvprep.

Ordinary narrative and explanation rather than code or lists, so that a chat model's
next-token predictions on it are confident in places and uncertain in others, which is
where a perturbed cache would show. About 3,000 characters: several hundred tokens with
Qwen's tokenizer (and more with the tiny checkpoints' small vocabulary).
"""

PASSAGE = """\
The harbour town woke before the sun. Fishing boats left one after another, their engines
coughing in the cold air, and the baker on the corner opened his shutters to let the smell
of warm bread drift down to the water. Mara had lived above that bakery for eleven years.
She kept the lighthouse at the end of the northern pier, although the light itself had
been automatic for longer than she could remember, and her real work was keeping records.

Every morning she walked the length of the pier and wrote down what she saw: the height
of the tide, the direction of the wind, the colour of the sky over the islands, the number
of boats that had gone out and the number that had come back. Nobody had asked her to do
this. The harbour office had its own instruments, and the weather service published better
forecasts than anything she could make with a notebook and a pencil. Still, she believed
that a place should be watched by someone who cared about it, and that small observations,
written down faithfully for many years, would one day tell a story that the instruments
could not.

Her notebooks filled three shelves in the small room at the base of the tower. Visitors
sometimes asked to read them, expecting adventure, and went away disappointed. There were
no shipwrecks in those pages, only wind from the west, light rain, eleven boats out and
eleven back. But a young student from the university once spent a whole summer copying
the numbers into a computer, and at the end of it she showed Mara a picture. It was a
simple chart of the first warm day of each spring, one dot for every year, and the dots
drifted slowly and unmistakably toward the start of the calendar.

Mara looked at the chart for a long time. She had not noticed the change while it was
happening, because no single year had seemed unusual. Each spring had simply arrived when
it arrived. Only the long patient list made the pattern visible, the way a path across a
field appears only after many people have walked the same way.

After that summer she began to write more carefully. She noted the first swallows and the
last frost, the day the baker switched from heavy winter loaves to the light summer bread,
and the week the children started swimming off the rocks below the tower. She did not know
which of these details would matter. That was the point, she told the student when they
spoke on the telephone in the autumn: you cannot know in advance which observation will be
the important one, so you record all of them as honestly as you can, and you trust that
someone, someday, will ask the right question.

In the evenings she sometimes sat at the top of the tower and watched the beam turn above
her head. It swept the dark water, touched the islands, and came back again, steady and
patient, every twelve seconds, all night long. She liked to think that her notebooks were a
kind of light as well, slower than the lamp but reaching much further, out across the years
instead of across the sea.
"""
