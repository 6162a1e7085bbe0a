PROMPTS = ["Once upon a time, there was a little", "The weather today is", "She opened the box and found",
           "In the middle of the forest", "Tom and his dog went to the park"]
