set terminal pngcairo noenhanced size 1000,560 font 'DejaVu Sans,10'
set output '../largest.png'
set title 'Largest-model search, world 4: peak resident memory per rank (largest over ranks) of every probe'
set xlabel 'parameters (millions)'
set ylabel 'peak RSS per rank (MiB)'
set logscale x
set grid
set key left top
set yrange [0:2048]
plot 'largest.dat' index 0 using 1:2 with linespoints pt 7 lc rgb '#1f77b4' title 'FULL_SHARD, malloc default: whole process', 'largest.dat' index 0 using 1:3 with linespoints pt 6 dt 2 lc rgb '#1f77b4' title 'FULL_SHARD, malloc default: steps only', 'largest.dat' index 1 using 1:2 with linespoints pt 7 lc rgb '#d62728' title 'FULL_SHARD, malloc mmap: whole process', 'largest.dat' index 1 using 1:3 with linespoints pt 6 dt 2 lc rgb '#d62728' title 'FULL_SHARD, malloc mmap: steps only', 'largest.dat' index 2 using 1:2 with linespoints pt 7 lc rgb '#2ca02c' title 'py_FULL_SHARD, malloc default: whole process', 'largest.dat' index 2 using 1:3 with linespoints pt 6 dt 2 lc rgb '#2ca02c' title 'py_FULL_SHARD, malloc default: steps only', 'largest.dat' index 3 using 1:2 with linespoints pt 7 lc rgb '#ff7f0e' title 'py_FULL_SHARD, malloc mmap: whole process', 'largest.dat' index 3 using 1:3 with linespoints pt 6 dt 2 lc rgb '#ff7f0e' title 'py_FULL_SHARD, malloc mmap: steps only', 1024 with lines lw 2 lc 'black' dt 3 title 'cap (1024 MiB)'
